"""Labs support: the checkers and the grading of the classroom labs in `notebooks/labs/`. An outer layer.

In every lab a student writes one real piece of the engine (a policy, the gates, the
padded batch's bookkeeping, a block manager, the chunk schedule) and plugs it into a
real `Engine`. These modules hold what the lab notebooks call: how to plug the piece in
(`use_*`), and the checks, whose failure (`LabCheckFailed`) says *what* is wrong and
*where* to look; and how a submission is graded (SPEC L1-L3, docs/teaching.md).

    common.py       LabCheckFailed, the tiny engine, running student code (bounded in time,
                    quiet, a crash as one message naming the function and its input), draining
    guard.py        the public checks refuse the engine's own implementation at run time too
    fcfs.py         lab 1: the FCFS policy            gates.py   lab 2: G1, G2, G3
    vtc.py          lab 3: VTC and the 2U bound       padded.py  lab 4: splice-in, removal, positions
    blocks.py       lab 5: the block manager          chunked.py lab 6: the chunk schedule
    capstone.py     lab 7: your own policy against FCFS and VTC on `minserve bench`
    differential.py the hidden checks' machinery: the piece beside the engine's own, on
                    random operation sequences drawn from the instructor's secret (L1)
    allowlist.py    what a graded cell may use, checked before it runs (L2)
    grading.py      a submission graded from its notebook file, its graded cell alone, in a
                    fresh process that loaded the checks first (L2)
    otter_plugin.py grading.py inside `otter run` (the kernel runs nothing of the submission)
    similarity.py   how much of a graded cell is the engine's code renamed (L3)

May import: the core and its front (it builds Engines and plugs pieces into them), its
own modules and `minserve.bench` (the capstone scores a policy with the benchmark's own workload and
metrics); Hypothesis and otter-grader where grading needs them (the `dev` extra). Never
imported by the core.
"""
