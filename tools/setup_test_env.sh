#!/usr/bin/env bash
# Installs bubblewrap when it is missing (the code sandbox's isolation tests need it), then
# prepares the side environments the tests need beside the main one (each a virtual environment
# of its own, because it pins packages the main environment must not get), and reuses one whose
# requirements have not changed since it was built.
#
#   bash tools/setup_test_env.sh            # every side environment in tools/side-envs/
#   bash tools/setup_test_env.sh triton36   # only the named ones
#
# Side environments live in $AGENTRL_FAST_SIDE_ENVS (default ~/.cache/agentrl_fast/side-envs),
# one folder per tools/side-envs/NAME.txt; tests find them there (tests/side_envs.py). A
# tools/side-envs/NAME.post.sh runs after the install (with $PY the environment's python). A line
# `# sees-main-environment` in NAME.txt makes the environment see the main one's packages (torch,
# transformers, agentrl_fast), a virtual environment or not. An environment is rebuilt when its
# reuse key changes: its requirements and post script, and for one that sees the main
# environment also that environment's torch and transformers (tools/side_env.py).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
specs="$root/tools/side-envs"
home=${AGENTRL_FAST_SIDE_ENVS:-$HOME/.cache/agentrl_fast/side-envs}
python=${PYTHON:-python}  # the main environment: the one the README command installed into
mkdir -p "$home"

# The sandbox's isolation tests need bubblewrap (tests/test_sandbox_isolation.py; under CI=true
# a missing one fails them). CI runs as root, so install it when it is missing.
if ! command -v bwrap > /dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get > /dev/null 2>&1; then
    echo "setup_test_env: installing bubblewrap"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } \
      || { echo "setup_test_env: could not install bubblewrap (apt-get failed)" >&2; exit 1; }
  else
    echo "setup_test_env: bubblewrap (bwrap) is missing; install it as root:" \
         "apt-get install bubblewrap" >&2
    exit 1
  fi
fi

# The npm MCP servers the MCP tests run with node (tests/test_mcp_tools.py; under CI=true a
# missing one fails them): installed into a cache folder, reused when present; never npx at test
# time. Only on a full setup (no names given).
npm_prefix=${AGENTRL_FAST_NPM:-$HOME/.cache/agentrl_fast/npm}
npm_packages=("@modelcontextprotocol/server-memory@2026.8.31")
if [ $# -eq 0 ]; then
  for package in "${npm_packages[@]}"; do
    if [ -f "$npm_prefix/node_modules/${package%@*}/package.json" ] \
        && grep -q "\"version\": \"${package##*@}\"" "$npm_prefix/node_modules/${package%@*}/package.json"; then
      echo "setup_test_env: $package is up to date ($npm_prefix)"
    elif command -v npm > /dev/null 2>&1; then
      echo "setup_test_env: installing $package into $npm_prefix"
      npm install --no-audit --no-fund --prefix "$npm_prefix" "$package" > /dev/null \
        || { echo "setup_test_env: npm install $package failed" >&2; exit 1; }
    else
      echo "setup_test_env: npm is missing; install Node.js (apt-get install nodejs npm) for" \
           "$package" >&2
      exit 1
    fi
  done
fi

names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for spec in "$specs"/*.txt; do names+=("$(basename "$spec" .txt)"); done
fi

for name in "${names[@]}"; do
  spec="$specs/$name.txt"
  [ -f "$spec" ] || { echo "setup_test_env: no side environment named $name ($spec)" >&2; exit 2; }
  env_dir="$home/$name"
  post="$specs/$name.post.sh"
  want=$("$python" "$root/tools/side_env.py" key "$name")
  if [ -x "$env_dir/bin/python" ] && [ "$want" = "$(cat "$env_dir/requirements.txt" 2>/dev/null)" ]; then
    echo "setup_test_env: $name is up to date ($env_dir)"
    continue
  fi
  echo "setup_test_env: building $name in $env_dir"
  start=$(date +%s)
  rm -rf "$env_dir"
  "$python" -m venv "$env_dir"
  if grep -qx '# sees-main-environment' "$spec"; then
    site_dir=$("$env_dir/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    "$python" "$root/tools/side_env.py" link "$site_dir" > /dev/null
  fi
  "$env_dir/bin/python" -m pip install -q --disable-pip-version-check -r "$spec"
  if [ -f "$post" ]; then PY="$env_dir/bin/python" bash "$post"; fi
  # Written last: an interrupted build is rebuilt next time.
  printf '%s' "$want" > "$env_dir/requirements.txt"
  echo "setup_test_env: $name ready in $(( $(date +%s) - start )) s"
done
