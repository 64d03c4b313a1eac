"""Nothing lost: checkpoint storage (storage.py), which checkpoint a run resumes
and how (resume.py), and the signals that save and stop a run (signals.py).
"""
