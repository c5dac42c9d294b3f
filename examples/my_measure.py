"""A user's measure, outside posbench: how often the model's top guess is the next byte.

Score a trained run with `posbench evaluate results/default/rope-seed0 --measure
examples.my_measure:NextByteAccuracy` (from the repository root); every later `posbench report`
of its experiment holds a table of it by length, with intervals over seeds, a plot
(next_byte.png), LaTeX and, with a tracker, a series eval/next_byte_accuracy.

Why it is useful: perplexity averages the whole distribution, so a scheme can lose perplexity
past its training length while still putting its top guess right; top-1 accuracy says which.
"""

from posbench.measures import Metric, Scorer


class NextByteAccuracy(Scorer):
    name = "next_byte"  # its records: RUN/measures/next_byte.csv
    metrics = {
        "next_byte_accuracy": Metric(
            "next_byte_accuracy", "% next bytes guessed", higher_is_better=True, digits=1, scale=100
        ),
    }

    def score(self, run):
        rows = []
        for L in run.lengths:
            if run.model.max_len is not None and L > run.model.max_len:
                rows.append({"length": L, "status": "beyond-max-len"})  # the scheme cannot encode L
                continue
            right = total = 0
            for x, y in run.windows(L):  # (b, L) inputs and their next tokens
                guess = run.model(x).argmax(-1)  # (b, L)
                right += (guess == y).sum().item()
                total += y.numel()
            rows.append({"length": L, "next_byte_accuracy": right / total if total else float("nan")})
        return rows
