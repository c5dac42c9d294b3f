"""A task run scored, the torch side: greedy decoding, exact match and per-token accuracy, batched by length.

posbench/measures/exact_match/score.py calls these and writes the records.
"""

from __future__ import annotations

from typing import Optional

import torch

from posbench.device import autocast

DECODE_BATCH = 256  # instances decoded at once


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    """The model's `steps` next bytes after each prompt, each the argmax given the ones before:
    prompts (B, P) of one length -> answers (B, steps)."""
    x = prompts
    for _ in range(steps):
        with autocast(x.device):
            logits = model(x)  # (B, T, V)
        nxt = logits[:, -1].float().argmax(-1)  # (B,): the byte after the last one
        x = torch.cat([x, nxt[:, None]], dim=1)  # (B, T+1)
    return x[:, prompts.size(1) :]


def decode(model, instances: list[tuple[bytes, bytes]], device) -> list[Optional[bytes]]:
    """Each instance's greedy answer, as long as its target (None where the model cannot encode
    the length). Instances are batched by prompt length, so no prompt is padded."""
    max_len = getattr(model, "max_len", None)
    answers: list[Optional[bytes]] = [None] * len(instances)
    by_len: dict[int, list[int]] = {}
    for i, (p, _) in enumerate(instances):
        by_len.setdefault(len(p), []).append(i)
    for P, idx in by_len.items():
        for k in range(0, len(idx), DECODE_BATCH):
            chunk = idx[k : k + DECODE_BATCH]
            steps = max(len(instances[i][1]) for i in chunk)
            if max_len is not None and P + steps - 1 > max_len:
                continue  # the last step would read past the positions the scheme encodes
            prompts = torch.tensor([list(instances[i][0]) for i in chunk], dtype=torch.long, device=device)
            out = greedy(model, prompts, steps).cpu()  # (b, steps)
            for row, i in zip(out.tolist(), chunk):
                answers[i] = bytes(row[: len(instances[i][1])])
    return answers


@torch.no_grad()
def bytes_right(model, instances: list[tuple[bytes, bytes]], device) -> list[Optional[int]]:
    """How many of each instance's answer bytes the model gets right (None where it cannot
    encode the length), teacher-forced: each byte is the argmax given the prompt and the
    answer's true bytes before it, not the model's own earlier answer. One forward pass over
    prompt + answer per batch."""
    max_len = getattr(model, "max_len", None)
    right: list[Optional[int]] = [None] * len(instances)
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, (p, a) in enumerate(instances):
        by_shape.setdefault((len(p), len(a)), []).append(i)
    for (P, A), idx in by_shape.items():
        if max_len is not None and P + A - 1 > max_len:
            continue  # greedy's last step would read past the positions the scheme encodes
        for k in range(0, len(idx), DECODE_BATCH):
            chunk = idx[k : k + DECODE_BATCH]
            seqs = torch.tensor([list(instances[i][0] + instances[i][1]) for i in chunk], device=device)  # (b, P+A)
            with autocast(seqs.device):
                logits = model(seqs[:, :-1])  # (b, P+A-1, V)
            pred = logits[:, P - 1 :].float().argmax(-1)  # (b, A): the byte after the prompt and each answer prefix
            for i, n in zip(chunk, (pred == seqs[:, P:]).sum(-1).tolist()):  # (b,): answer bytes right
                right[i] = n
    return right


def exact(
    model, instances: list[tuple[bytes, bytes]], device, right: Optional[list[Optional[int]]] = None
) -> list[Optional[bool]]:
    """Whether greedy decoding gives each instance's whole answer (None where the model cannot
    encode the length), from `bytes_right`'s one teacher-forced pass (`right`, where the caller
    has it): greedy decoding emits the answer exactly when, at every answer byte, the argmax
    given the answer's bytes before it is that byte (by induction over the bytes; the same
    argmax, so ties too). It equals `decode(...) == answer` (tests/test_tasks.py checks) at a
    forward per batch rather than one per answer byte, where a byte's logits depend only on the
    bytes before it. A scheme that draws its positions per forward call (noisy_<s>) breaks
    that: a prefix decoded alone gets other positions than inside one pass, so its answers are
    decoded."""
    if not getattr(getattr(model, "scheme", None), "prefix_consistent", True):
        model.eval()  # its draws from their first again: the same answers whoever decodes after what
        return [None if got is None else got == a for got, (_, a) in zip(decode(model, instances, device), instances)]
    right = bytes_right(model, instances, device) if right is None else right
    return [None if n is None else n == len(a) for n, (_, a) in zip(right, instances)]


def score(model, test: list[tuple[int, bytes, bytes]], device) -> list[dict]:
    """Both metrics per test length: rows (length, correct, instances, accuracy, tokens_correct,
    tokens, token_accuracy, status). Exact match: an instance counts only if every byte of its
    answer, END included, is the target's, which is what greedy decoding gives. Per-token
    accuracy: the answer bytes right over all answer bytes (END included), teacher-forced (see
    `bytes_right`), so one wrong byte does not cost the bytes after it."""
    model.eval()
    pairs = [(p, a) for _, p, a in test]
    right = bytes_right(model, pairs, device)
    whole = exact(model, pairs, device, right)
    rows = []
    for n in sorted({n for n, _, _ in test}):
        mine = [(r, len(a), w) for (m, _, a), r, w in zip(test, right, whole) if m == n]  # (right, bytes, exact)
        tokens = sum(A for _, A, _ in mine)
        if any(r is None for r, _, _ in mine):
            rows.append(
                {
                    "length": n,
                    "correct": "",
                    "instances": len(mine),
                    "accuracy": "",
                    "tokens_correct": "",
                    "tokens": tokens,
                    "token_accuracy": "",
                    "status": "beyond-max-len",
                }
            )
            continue
        correct = sum(bool(w) for _, _, w in mine)
        tokens_correct = sum(r for r, _, _ in mine)
        rows.append(
            {
                "length": n,
                "correct": correct,
                "instances": len(mine),
                "accuracy": correct / len(mine),
                "tokens_correct": tokens_correct,
                "tokens": tokens,
                "token_accuracy": tokens_correct / tokens,
                "status": "ok",
            }
        )
    return rows


def show(b: Optional[bytes]) -> str:
    if b is None:
        return "(not decoded: beyond the scheme's positions)"
    return "".join(chr(c) if 32 <= c < 127 else f"\\x{c:02x}" for c in b)
