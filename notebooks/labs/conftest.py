"""The lab notebooks are otter-assign *sources*: solution and stub side by side, test cells,
raw config cells. They are not lessons to replay under strict nbval; `tests/test_labs.py`
builds them with otter and grades the generated versions (`make lab-check`)."""

collect_ignore_glob = ["*.ipynb"]
