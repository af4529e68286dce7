"""What people look at: the one progress line, the per-step metrics log, reward curves, trace pages.

    progress.py    progress_line / bar / emit: the line rollout, train and bench print
    steplog.py     StepLog: metrics.jsonl (+ TensorBoard, W&B) and curves.html
    plots.py       dependency-free SVG line charts in one HTML page
    trace_html.py  episodes as HTML, tokens shaded by mask and logprob

May import: the vocabulary, util and models (to load a run's tokenizer). Only rollout, train, bench and
the CLI import it.
"""
