"""Figures and tables read from finished work: pass@k reports, training curves, trust-region plots, the catalogue."""
