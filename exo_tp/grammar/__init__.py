"""Structured outputs by constrained decoding (llguidance): a request's `Constraint` compiled
for the model's tokenizer (`compiler`), and the logits processor that masks the tokens the
grammar does not allow at each step (`mask`)."""
