"""Jinja2 templates of the files pipec emits (shipped inside the wheel as ``pipec.templates``)."""
