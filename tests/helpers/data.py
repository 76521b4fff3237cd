"""Files a test uploads as a user would."""
from tests.helpers.service import ROOT


def iris_csv() -> bytes:
    """The shipped Iris set as a user's CSV: named columns, the species by name."""
    lines = (ROOT / "worker" / "datasets" / "iris.csv").read_text().splitlines()
    names = lines[0].split(",")[2:]
    rows = ["sepal_length,sepal_width,petal_length,petal_width,species"]
    rows += [",".join([*v[:4], names[int(v[4])]]) for v in (line.split(",") for line in lines[1:])]
    return ("\n".join(rows) + "\n").encode()
