"""The README's claims that a command prints, held to what runs (the make 3d sample: .ci/run
holds it to a whole run with tests/readme_sample.py; here, that checker itself)."""
import re
from pathlib import Path

import readme_sample


def as_printed(sample):   # the README's lines, each "..." two lines of a run's in its place
    printed = []
    for line in sample:
        if line.strip() == "...":
            printed += ["[dp0 pp1 tp0] step   1  loss 4.1", "[dp0 pp1 tp0] step   2  loss 4.0"]
        else:
            printed.append(line)
    return printed


def test_the_make_3d_sample_passes_as_printed_and_fails_with_a_line_dropped_unsaid():
    sample = readme_sample.shown()
    assert sample[0] == readme_sample.START and "check OK" in sample
    printed = as_printed(sample)
    assert readme_sample.mismatch(sample, printed) is None
    made = ["installing torch==2.13.0 pytest (first run only)", ".venv/bin/python three_d.py"]
    assert readme_sample.mismatch(sample, made + printed) is None   # make's lines before
    other_numbers = [line.replace("1.9", "1.8") for line in printed]   # another CPU's rounding
    assert readme_sample.mismatch(sample, other_numbers) is None
    elsewhere = [re.sub(r"ok \(.*\)$", "ok (head)", line) for line in printed]   # its worst too
    assert elsewhere != printed and readme_sample.mismatch(sample, elsewhere) is None
    failed = [line.replace("ok (", "FAILED (") for line in printed]
    assert readme_sample.mismatch(sample, failed) is not None
    for dropped in (next(line for line in sample if line.startswith("loss ")), "check OK"):
        assert readme_sample.mismatch(sample, [line for line in printed if line != dropped]) \
            is not None
    at = next(k for k, line in enumerate(printed) if line.startswith("validation loss")) + 1
    extra = printed[:at] + ["a line the README does not show"] + printed[at:]
    assert readme_sample.mismatch(sample, extra) is not None


def test_the_readme_names_each_lectures_parts_as_its_headings_do():
    """"How the steps read" lists step 2's and step 3's parts: each file's `# Part` headings, in
    order, word for word."""
    root = Path(__file__).resolve().parent.parent
    text = " ".join((root / "README.md").read_text().split())
    for step, script in (("2", "data_parallel.py"), ("3", "tensor_parallel.py")):
        listed = re.search(rf"Step {step}: (.*?)\. ", text).group(1).split("; ")
        headings = re.findall(r"^# Part \d+: (.*?) -+$", (root / script).read_text(), re.M)
        assert len(headings) >= 3 and listed == headings, (listed, headings)
