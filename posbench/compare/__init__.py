"""The comparison engine: every table and plot of every measure.

One engine for every table and plot: the order of rows (order.py), the cells and ties
(table.py), Markdown and LaTeX (render.py), and the plots (plot.py)."""
