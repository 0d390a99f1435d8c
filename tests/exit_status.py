"""Run `python ARGS...` as a child, write its exit status to $STATUS_DIR/status.<RANK>, and exit with it.

torchrun reports no rank's exit code once it has forwarded a signal (it raises, and exits 1): a test that must see
every rank exit 0 after a preemption runs each rank through this wrapper. The child stays in this process's group,
so the signals torchrun sends to the group reach the child and its DataLoader workers as they would without the
wrapper. A status is the child's return code: negative for a signal (-9: torchrun's SIGKILL after its timeout).

    torchrun --standalone --nproc-per-node 2 tests/exit_status.py train_fsdp.py --steps 8
"""

import os
import signal
import subprocess
import sys

# A SIGTERM must not end the wrapper before the child: a handler that does nothing (SIG_IGN would be inherited
# by the child through exec; a handler is not).
signal.signal(signal.SIGTERM, lambda *_: None)
child = subprocess.Popen([sys.executable, *sys.argv[1:]])
status = child.wait()
path = os.path.join(os.environ["STATUS_DIR"], f"status.{os.environ['RANK']}")
with open(path + ".part", "w") as f:
    f.write(str(status))
os.replace(path + ".part", path)  # whole or not at all
sys.exit(status if status >= 0 else 128 - status)
