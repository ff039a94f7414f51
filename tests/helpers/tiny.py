"""The tiny Llama most tests train: width 64, 2 layers, 4 query heads sharing 2 key/value heads."""

TINY_MODEL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2"]
