#!/bin/sh
# Entry point of the ddtree images. `ddtree serve` binds 127.0.0.1 by default, which nothing outside the
# container's network namespace can reach, so `ddtree serve ...` gets `--host 0.0.0.0` (and `--device
# $DDTREE_DEVICE` in the CUDA image) put in front of the caller's flags; argparse keeps the last value, so an
# explicit --host or --device still wins. Flags alone (`docker run IMAGE --drafter none`) mean `ddtree serve`.
# Anything else runs as given. exec: the server is PID 1 and receives SIGTERM itself, which starts its drain.
set -e

if [ "$#" -eq 0 ]; then
    set -- ddtree serve
fi
case "$1" in
    -*) set -- ddtree serve "$@" ;;
esac
if [ "$1" = "ddtree" ] && [ "${2:-}" = "serve" ]; then
    shift 2
    if [ -n "${DDTREE_DEVICE:-}" ]; then
        set -- --device "$DDTREE_DEVICE" "$@"
    fi
    set -- ddtree serve --host 0.0.0.0 "$@"
fi
exec "$@"
