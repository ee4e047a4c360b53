"""OpenAI-format entrypoints: `pagedlm run-batch`, the OpenAI batch file format (as vLLM's).

`protocol.py` turns OpenAI request bodies into engine requests (one handler per url) and
`responses.py` engine outputs into OpenAI response bodies; `run_batch.py` is the command: it
streams the input file through the engine and writes each result line as soon as its request
finishes.
"""
