"""The multi-user chat demo's logic (SPEC H4). An outer layer.

`app.py` at the repository root is the Gradio page and its command line;
`logic.py` is what the page *does*, with no Gradio import, so it reads and
tests like the rest of the package: one browser tab = one fair-policy
session, friendly gate refusals, the noisy-neighbour flood, the live panel.

May import: the core and its front (an `Engine` is passed in), `minserve.inspection`
(the panel's figures and trace helpers) and `minserve.server` (the refusal rule and
the engine-knob flags, so the chat and the HTTP server agree). Never imported
by the core, the server or inspection (the bench imports it, to time the demo).
"""
