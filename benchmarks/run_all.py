"""Run every benchmark in this folder in turn (`make bench`). Each prints one JSON line."""

import subprocess
import sys
from pathlib import Path

here = Path(__file__).parent
for script in sorted(here.glob("bench_*.py")):
    print(f"# {script.name}", flush=True)
    subprocess.run([sys.executable, str(script)], check=False)
