import sys
import tempfile
from pathlib import Path

from fanfold import Fleet

sys.path.insert(0, str(Path(__file__).parent / "swe_image"))
import build  # noqa: E402 - a SWE task image: more-itertools 10.2.0 with one bug, as an OCI layout

with tempfile.TemporaryDirectory() as tmp, Fleet() as fleet:
    build.build(Path(tmp) / "layout")                      # or push it: build.py --push HOST/NAME:TAG
    image = fleet.import_image(Path(tmp) / "layout", ref="example.org/swe/more-itertools:padded")
    print(image.user, image.workdir, len(image.layers))    # its USER, WorkingDir and 2 layers
    with fleet.create("example.org/swe/more-itertools:padded") as sandbox:
        print(sandbox.exec("id -un; python3 -m unittest tests.test_more.PaddedTest 2>&1 | tail -1").text)
        print(sandbox.exec("id -un", user="root").text)    # any exec may run as another user
