"""`orthoptim train`: a small GPT (model.py), its data (data.py), the loop (loop.py), results and plots
(results.py), the progress line (progress.py)."""
