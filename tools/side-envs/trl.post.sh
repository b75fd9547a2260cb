# Run by tools/setup_test_env.sh after installing trl.txt, with $PY the environment's python:
# torch and transformers must still be the main environment's.
"$PY" - <<'PYEOF'
import sys

import torch
import transformers

for module in (torch, transformers):
    if module.__file__.startswith(sys.prefix):
        sys.exit(f"trl side environment: pip installed its own {module.__name__} "
                 f"({module.__version__}); it must use the main environment's")
PYEOF
