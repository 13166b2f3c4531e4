"""Labs support: the checkers behind the classroom labs in `notebooks/labs/`. An outer layer.

In every lab a student writes one real piece of the engine (a policy, the gates, the
padded batch's bookkeeping, a block manager, the chunk schedule) and plugs it into a
real `Engine`. These modules hold what the lab notebooks call: how to plug the piece in
(`use_*`), and the checks, whose failure (`LabCheckFailed`) says *what* is wrong and
*where* to look. The autograder's hidden tests call the same checks on other inputs.

    common.py    LabCheckFailed, the tiny engine, running student code (bounded in time,
                 quiet, a crash as one message naming the function and its input), draining
    guard.py     no shortcut through the reference: every check runs under guarded_check
    fcfs.py      lab 1: the FCFS policy            gates.py   lab 2: G1, G2, G3
    vtc.py       lab 3: VTC and the 2U bound       padded.py  lab 4: splice-in, removal, positions
    blocks.py    lab 5: the block manager          chunked.py lab 6: the chunk schedule
    capstone.py  lab 7: your own policy against FCFS and VTC on `minserve bench`

May import: the core and its front (it builds Engines and plugs pieces into them), its
own modules and `minserve.bench` (the capstone scores a policy with the benchmark's own workload and
metrics). Never imported by the core.
"""
