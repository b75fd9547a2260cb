# Run by tools/setup_test_env.sh after installing verl.txt, with $PY the environment's python.
# verl's declared pins (transformers<5.11, ...) would replace the project's packages: install it
# alone, then check that torch and transformers are still the main environment's.
"$PY" -m pip install -q --disable-pip-version-check --no-deps verl==0.9.1
"$PY" - <<'PYEOF'
import sys

import torch
import transformers

for module in (torch, transformers):
    if module.__file__.startswith(sys.prefix):
        sys.exit(f"verl side environment: pip installed its own {module.__name__} "
                 f"({module.__version__}); it must use the main environment's")
PYEOF
