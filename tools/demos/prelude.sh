# Sourced by bin/demo and tools/demos/*.sh, from the repository root: what every demo does before
# its own work, in one copy.
# demo_prelude SCRIPT WHO ARGS...
#   -h/--help among ARGS: print SCRIPT's header comment (line 2 up to `set -euo`) and bin/train's
#   options, then exit 0, touching nothing; else, with no .venv, tell WHO's user to run bin/setup
#   (exit 1).
demo_prelude() {
  local script=$1 who=$2 arg
  shift 2
  for arg in "$@"; do
    if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
      sed -n '2,/^set -euo/p' "$script" | sed '$d' | sed 's/^# \{0,1\}//'
      echo
      [[ ! -x .venv/bin/python ]] || .venv/bin/python bin/train --help
      exit 0
    fi
  done
  if [[ ! -x .venv/bin/python ]]; then
    echo "$who: no virtualenv at $PWD/.venv: run bin/setup first (it creates .venv), then $who again" >&2
    exit 1
  fi
}
