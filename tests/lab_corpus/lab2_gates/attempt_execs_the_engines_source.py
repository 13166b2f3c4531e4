# attempt: the gates are minserve's own, their source read with inspect and exec'd under the lab's names
# expect: the graded cell was not run
# expect: `import inspect` is not allowed
import inspect

from minserve import gates as core

for name in ("check_queue_capacity", "check_kv_budget", "check_block_pool"):
    exec(inspect.getsource(getattr(core, name)))
