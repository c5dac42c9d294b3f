"""The corpus language model (task lm): random windows of the corpus at train_len, next-token loss.

Its runs read the corpus (posbench/data.py) and are scored by perplexity
(posbench/measures/perplexity/). The corpus's tokenizer decides the vocabulary.
"""

from __future__ import annotations

import json
from typing import Optional

from posbench.errors import PosbenchError
from posbench.tasks.base import TrainingTask

LM = "lm"  # the task's name in a config
DEFAULT_BUDGET = {"steps": 500, "batch_size": 16}  # 500 x 16 x 100 tokens: enough for the schemes' order to show


class CorpusTask(TrainingTask):
    name = LM

    def decide(self, cfg) -> None:
        if cfg.task_options:
            raise PosbenchError("task_options are set but task is lm: set task, e.g. task: copy", "task_options")
        for key, value in DEFAULT_BUDGET.items():
            if getattr(cfg.train, key) is None:
                setattr(cfg.train, key, value)
        decide_vocab(cfg)

    def measure(self):
        from posbench.measures.perplexity import Perplexity

        return Perplexity()

    def source(self, rc, reporter=None):
        from posbench.data import load_corpus

        return load_corpus(rc.data, reporter.note if reporter is not None else None)

    def source_key(self, rc) -> str:
        return json.dumps(rc.to_dict()["data"], sort_keys=True)

    def fingerprint(self, corpus) -> Optional[str]:
        return corpus.sha256()

    def batches(self, rc, corpus):
        from posbench.data import CorpusBatches

        return CorpusBatches(corpus, rc.train.batch_size, rc.model.train_len)

    def identity(self, part: dict) -> dict:
        """A language model reads the corpus and no task: its task settings decide nothing."""
        return {k: v for k, v in part.items() if k not in ("task", "task_options")}

    def throughput(self, cfg) -> tuple[int, str]:
        """A step reads batch_size windows of train_len tokens each."""
        return cfg.train.batch_size * cfg.model.train_len, "tokens_per_s"

    def padding_benchmark(self) -> Optional[str]:
        return "a corpus's batches are all one length; give a task, e.g. --task copy"

    def not_extendable(self, cfg) -> Optional[str]:
        return None


def decide_vocab(cfg) -> None:
    """model.vocab_size follows data.tokenizer: at least the 256 bytes, or the tokenizer's size
    (read from its file, or data.vocab_size for a BPE still to train)."""
    from posbench.text import BYTE_ALPHABET, is_prepared, tokenizer_kind, vocab_of

    if tokenizer_kind(cfg.data.tokenizer) == "bytes" and not is_prepared(cfg.data.path):
        if cfg.model.vocab_size < BYTE_ALPHABET:
            raise PosbenchError(
                f"model.vocab_size={cfg.model.vocab_size}: the corpus is bytes, so it must be >= 256",
                "model.vocab_size",
            )
        return
    if is_prepared(cfg.data.path):  # its tokens were made by one tokenizer: the config takes it
        from posbench.text import read_prepared_meta

        meta = read_prepared_meta(cfg.data.path)
        given = cfg.origins.get("data.tokenizer") and (cfg.data.tokenizer, cfg.data.vocab_size)
        if given and given != (meta["spec"], meta["bpe_vocab_size"]):
            raise PosbenchError(
                f"data.path {cfg.data.path} holds tokens of {meta['tokenizer']}, not of data.tokenizer "
                f"{cfg.data.tokenizer}; leave data.tokenizer unset to use its own",
                "data.tokenizer",
            )
        cfg.data.tokenizer, cfg.data.vocab_size = meta["spec"], meta["bpe_vocab_size"]
    vocab = vocab_of(cfg.data)
    if "model.vocab_size" in cfg.origins and cfg.model.vocab_size != vocab:
        raise PosbenchError(
            f"model.vocab_size={cfg.model.vocab_size}, but data.tokenizer {cfg.data.tokenizer} has {vocab} tokens; "
            f"leave model.vocab_size unset: it follows the tokenizer",
            "model.vocab_size",
        )
    cfg.model.vocab_size = vocab
