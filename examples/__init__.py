"""Worked examples of posbench plugins; load one as `examples.my_scheme:MyScheme` from the repo root."""
