"""What is served: where model files come from, the models file and alias routes, and what a
GGUF file says (metadata, vocabulary) for every service that reads one.
"""
