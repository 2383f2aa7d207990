"""One request's decisions and what they leave behind: its lifecycle (admission, the
attempts, the choice of worker, how each attempt settles) and what the router learns
from it (prefill rates, turn outcomes, recent demand)."""
