"""The request frontend, shared by every engine: what turns a user's request into token ids
and a grammar, and the model's text back into a result.

`prompts.py` (chat template, schema description), `render.py` (the chat template rendered
within a time and a size bound), `tools.py` (tool definitions, the tool-call
grammar, calls read back), `reasoning.py` (reasoning markers, the reasoning options and the
request matcher) and `dsl.py` (the concise schema language of the command line).
`constrained_spec.api` sits on top.
"""
