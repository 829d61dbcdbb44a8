import sys
from pathlib import Path

# tests/models.py and tests/invariants.py are shared helpers, imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
