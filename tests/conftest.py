import sys
from pathlib import Path

# Make ``tests.helpers`` importable however pytest is invoked.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
