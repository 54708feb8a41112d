"""Evaluators and their reports, each module one job: cache policies (``cache``), the
start+recent cache (``start_recent``), the streaming evaluators (``scoring``, ``reference``,
``fast``, driven by ``streaming``), text sources (``texts``), sink diagnostics (``sinks``),
zero-shot (``zeroshot``, ``zeroshot_tasks``), reports (``report``, ``plots``) and ``sinklm
compare`` (``compare`` runs it, ``compare_cache``, ``compare_tables``, ``compare_report``)."""
