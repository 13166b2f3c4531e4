"""Sphinx's configuration for `make site` (scripts/course_site.py copies it into the staged
sources, build/site-src/, with the pages it made there). MyST-NB reads the lessons already
executed (nb_execution_mode "off"); the Sphinx Book Theme lays them out. Nothing here
may reach the network when the site is built or read: no CDN script (plotly.js is in
_static/, added only to the pages that draw a figure), no web font, no analytics."""

project = "minserve"
author = "the minserve authors"
extensions = ["myst_nb"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# MyST: GitHub's heading slugs, so that docs/'s `page.md#a-heading` links resolve
myst_heading_anchors = 6
myst_enable_extensions = ["colon_fence"]
suppress_warnings = ["myst.header", "misc.highlighting_failure"]

# MyST-NB: the lessons are executed by scripts/course_site.py (cached), never here
nb_execution_mode = "off"
nb_ipywidgets_js = {}  # no require.js or widget manager from a CDN: widgets became frames
nb_merge_streams = True
nb_render_markdown_format = "myst"

html_theme = "sphinx_book_theme"
html_title = "minserve: the course"
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_js_files = [("course.js", {"defer": "defer"})]
html_copy_source = False  # the pages are the site; no copy of their sources beside them
html_show_sourcelink = False
html_show_search_summary = False  # a summary is fetched from the page: blocked from disk
html_last_updated_fmt = None
html_context = {"default_mode": "light"}
html_theme_options = {
    "use_download_button": False,
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "navigation_with_keys": False,
    "show_toc_level": 2,
}


def _plotly_where_needed(app, pagename, templatename, context, doctree):
    """plotly.js (4 MB) only on the pages that draw a figure or hold stepper frames."""
    body = context.get("body", "")
    if "plotly-graph-div" in body or "stepper-frames" in body:
        app.add_js_file("plotly.min.js", priority=300)


def setup(app):
    app.connect("html-page-context", _plotly_where_needed)
