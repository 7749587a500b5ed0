#!/bin/sh
# Record the stack: the pinned versions (the recipe's build arguments, named on the command line) next to
# what the image actually holds, in /opt/mds/stack.json, and print every difference. PIN_CHECK=strict
# makes a difference fail the build; the default (warn) reports it, because a CPU test base differs
# from the GPU pins by design. The comparison is record_stack.py (tested on the host).
. "$(dirname "$0")/lib.sh"
step "record the stack (pinned vs found)"
"$PYTHON" "$(dirname "$0")/record_stack.py" "$@"
