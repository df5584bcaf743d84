"""The values a request is made of, shared by the front ends, the engine and the client: its
inputs and their tokenizer (``inputs``), prompts (``prompts``), what counts as text (``texts``)
and the failures (``errors``). It imports nothing else of kembed, so the client may take
``texts`` without the server."""
