"""Weight formats of the GEMMs: prepacked oneDNN (packed_linear.py) and weight-only quantized (quantized_linear.py)."""
