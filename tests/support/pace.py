"""How long tests wait for what only the machine's pace decides.

A Python process run to its end in a test spends most of its life importing (the monitor's
modules: about 2 s of CPU on an idle machine). With a second run of the suite beside the first on
two cores (load 40), importing the monitor took over 60 s. Where a test judges a process's exit
status and output, never its time, it waits :data:`PROCESS_SECONDS`: a process that hangs still
fails, only later.
"""

PROCESS_SECONDS = 300.0
