"""BORT2 (Robust Target Training for Multi-Source Domain Adaptation, BMVC 2022) on hypergrad."""
