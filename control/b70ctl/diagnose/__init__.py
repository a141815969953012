"""Known failures of the B70 DSpark recipes, named with their fix: a signature catalogue as data
(the catalogue/ folder), matched against serve logs, kernel logs and verify reports."""

from b70ctl.diagnose.catalogue import load_catalogue, load_catalogue_file
from b70ctl.diagnose.match import diagnose_lines
from b70ctl.diagnose.model import Catalogue, Diagnosis, LogLine, Match, Signature

__all__ = ["Catalogue", "Diagnosis", "LogLine", "Match", "Signature", "diagnose_lines", "load_catalogue",
           "load_catalogue_file"]
