"""Grading speed-up, on PYTHONPATH for the grading processes and their kernels only.

Every `otter run` starts a fresh kernel whose first cell imports otter, which imports
nbformat, which imports jsonschema, whose optional IRI format checker imports
`rfc3987_syntax`, which builds a parser grammar at import: about 2 s of CPU per kernel on
the 2-core machine this project is developed on, for a check no notebook schema uses
(jsonschema skips the "iri" formats when this import fails, as it does here). Grading
results are unchanged; docs/teaching.md gives the measured gain.
"""

raise ImportError("rfc3987_syntax skipped while grading (scripts/grading_shims)")
