"""Structured outputs: constraints compiled to grammars whose token masks bind the target and the drafters.

`backend.py` is the small interface a grammar library sits behind; `llguidance_backend.py` implements it.
`compiler.py` compiles a StructuredSpec (with a bounded LRU cache and limits), `state.py` is one request's
position in its grammar (masks for the draft prefixes, commit of what was emitted), `draft_mask.py` masks a
drafter's logits rows.
"""
