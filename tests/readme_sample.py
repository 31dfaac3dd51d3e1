"""The README's `make 3d` sample held to a run's output (.ci/run passes it make 3d's log):

    python tests/readme_sample.py LOG

Each line the README shows is a line the run printed, in the same order; a "..." line (any
indent) stands for one or more lines left out, and nowhere else is a line left out (before the
first: make's command line, the first call's install). Numbers
are compared by shape (every run of digits as one #), and so is the tensor or step where a check
line's largest difference fell; the sample's characters, drawn from the model, are not compared
(another CPU's rounding may give others): the README may show no line the run does not print,
and may drop none without saying so."""
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
START = "rank map: dp=2 pp=2 tp=2, order tp-pp-dp (fastest first)"


def shown():
    """The README's make 3d block, line by line."""
    text = README.read_text()
    start = text.index("```\n" + START) + 4
    return text[start:text.index("```", start)].splitlines()


def shape(line):   # "ok (blocks.1.wq)" as "ok (...)": where the largest difference fell
    line = re.sub(r"  (ok|FAILED) \(.*\)$", r"  \1 (...)", line)
    return re.sub(r"\d+", "#", line)


def mismatch(sample, printed):
    """None when sample (the README's lines) is printed (a run's lines) with only its "..."
    left out; else the README line past which no reading of the run goes."""
    deepest = [0]

    def fits(i, at, skipping, drawn):   # sample[i:] from printed[at:]
        deepest[0] = max(deepest[0], i)
        if i == len(sample):
            return True
        line = sample[i]
        if line.strip() == "...":
            return fits(i + 1, at, True, drawn)
        if drawn and not line.startswith("check against"):
            return fits(i + 1, at, skipping, drawn)       # the model's characters: free text
        ends = range(at, len(printed)) if skipping or drawn else range(at, min(at + 1, len(printed)))
        return any(shape(printed[k]) == shape(line) and
                   fits(i + 1, k + 1, line.startswith("a sample, "), line.startswith("a sample, "))
                   for k in ends)
    if fits(0, 0, True, False):           # what comes before (make's command, the install)
        return None
    return sample[min(deepest[0], len(sample) - 1)]


def main(argv):
    printed = Path(argv[0]).read_text().splitlines()
    wrong = mismatch(shown(), printed)
    if wrong is not None:
        sys.exit(f"error: the README's make 3d sample shows {wrong!r} where the run printed "
                 f"otherwise")
    print("the README's make 3d sample is what make 3d printed")


if __name__ == "__main__":
    main(sys.argv[1:])
