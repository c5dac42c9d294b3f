"""A user's synthetic task, outside posbench: a number, then the number plus one.

Train on it from the repository root with `posbench extrapolate --task examples.my_tasks:Increment`
(or `task: examples.my_tasks:Increment` in YAML). A task trains to its own recipe where the
config leaves the keys out, thousands of steps and hundreds of decoded answers a length, so a
first try at a tiny size is `--schemes nope --set train.steps=30 --set task_options.test_count=8`.

Why it is useful: the answer's carry runs from the last digit back, so a model must find the
right digits at every distance from the `=`; past the training lengths that is exactly what a
positional scheme has to extrapolate.
"""

from posbench.tasks import END, Task


class Increment(Task):
    name = "increment"
    description = "a number -> the number plus one"

    def make(self, n, rng):
        x = rng.randrange(10**n)
        return f"inc:{x:0{n}d}=".encode(), str(x + 1).encode() + END

    def longest(self, n):
        return 4 + n + 1 + (n + 1) + 1  # inc: x = x+1 .

    def space(self, n):
        return 10**n
