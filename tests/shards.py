"""make test: the suite as two pytest runs at once, each every other test (conftest.py's --shard).

A test here is mostly waiting: for ranks to start and meet, for a timeout to expire, for a child
to die. One run leaves this 2-core machine's cores idle a third of the time; two runs at once
fill them, and the suite takes 1/1.5 of the time. The first run prints as it goes; the second's
output follows when it ends (its failures, its summary). Exit: 0 if both passed, else the first
run's non-zero code, else the second's (a half with no test in it, pytest's 5, counts as passed
when the other ran some).

    python tests/shards.py [pytest's arguments]     # as `python -m pytest [arguments]`
"""
import subprocess
import sys
import tempfile
import time

SHARES = 2
NO_TESTS = 5          # pytest's exit code when it collected nothing to run


def main(argv):
    start = time.monotonic()
    command = [sys.executable, "-m", "pytest", *argv]
    with tempfile.TemporaryFile("w+") as second_output:
        second = subprocess.Popen([*command, "--shard", f"1/{SHARES}"], stdout=second_output,
                                  stderr=subprocess.STDOUT)
        try:
            first_code = subprocess.call([*command, "--shard", f"0/{SHARES}"])
            second_code = second.wait()
        except KeyboardInterrupt:   # Ctrl-C reached both runs: each has said what it stopped
            return 130
        finally:
            if second.poll() is None:
                second.kill()
        second_output.seek(0)
        print(f"\n--- the second half of the tests, run beside the first ---\n{second_output.read()}",
              end="", flush=True)
    print(f"both halves: {time.monotonic() - start:.0f} s")
    codes = [first_code, second_code]
    if NO_TESTS in codes and codes != [NO_TESTS, NO_TESTS]:
        codes.remove(NO_TESTS)
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
