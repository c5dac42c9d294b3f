"""Context extension by fine-tuning: `posbench extend` (methods.py says what each method does)."""
