"""One Python interpreter for a shell test's many Python calls (python.sh's pyserve_start and pyrun).

A test compares ShardTrain with Python by calling a checker script ten or more times; each call as its own process
paid ~5 s of CPU importing torch and transformers again, a quarter of some tests' time. This server runs each call
as `python SCRIPT ARGS...` would -- the script as __main__ with that sys.argv, its directory first on sys.path, its
stdout and stderr (file descriptors 1 and 2, so C++ output too) in files, its exit status -- in one interpreter, so
the imports happen once. Every checker seeds its random generators itself; nothing else carries from call to call
but imported modules.

    pyserve.py DIR

Reads request numbers N, one per line, from the FIFO DIR/in; runs the NUL-separated arguments in DIR/N.args with
stdout in DIR/N.out and stderr in DIR/N.err; writes the exit status as a line to the FIFO DIR/out. Ends at the
end of DIR/in.
"""
import os
import runpy
import sys
import traceback


def exit_status(code):
    """What `python SCRIPT` exits with after sys.exit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run(argv, base):
    """Runs argv[0] as __main__ with sys.argv = argv, stdout and stderr in base.out and base.err; its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    saved_argv, saved_path = sys.argv, list(sys.path)
    with open(base + ".out", "wb") as out, open(base + ".err", "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        try:
            runpy.run_path(argv[0], run_name="__main__")
            status = 0
        except SystemExit as e:
            status = exit_status(e.code)
        except BaseException:  # as the interpreter would: the traceback, status 1
            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sys.argv, sys.path[:] = saved_argv, saved_path
    return status


def main(directory):
    with open(os.path.join(directory, "in"), "rb") as requests, open(os.path.join(directory, "out"), "w") as replies:
        for line in requests:
            base = os.path.join(directory, line.decode().strip())
            with open(base + ".args", "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0")[:-1]]
            replies.write(f"{run(argv, base)}\n")
            replies.flush()


if __name__ == "__main__":
    main(sys.argv[1])
