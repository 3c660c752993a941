"""The data: what --data names and its tokenizer (source), token files prepared once (prepare), the batches
of each step, the same global batch for any world size and resumed exactly (batches), and the Hugging Face
hub's reach (hub). It imports common/ alone."""
