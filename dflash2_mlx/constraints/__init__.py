"""Constrained output: the llguidance grammar that masks plain steps, verify rows and the selector's walk."""
