"""The reward models that `rewards.py` scores with: the OCR judge (`genrm`: GenRM over HTTP or in-process with
transformers), the RapidOCR engine (`rapidocr`) and PickScore with open_clip (`pickscore`).

Each module imports only the standard library, numpy / torch / PIL and its model's own packages (lazily); none
imports `rewards` (the reward API, which imports them) or another of these modules.
"""
