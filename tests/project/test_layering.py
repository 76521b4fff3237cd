"""The layering contracts of pyproject.toml ([tool.importlinter]): kept by the tree as it is, and each one broken
by the import it forbids (added to the import graph, not to a file), so that a contract which checks nothing, or
names a room that no longer exists, fails here."""
import grimp
import pytest
from importlinter import configuration
from importlinter.application import use_cases
from importlinter.application.app_config import settings

configuration.configure()
# What `lint-imports` does before it reads contracts (import-linter is pinned in the test extra).
use_cases._register_built_in_contract_types()
OPTIONS = use_cases.read_user_options("pyproject.toml")
CONTRACTS = {c["id"]: c for c in OPTIONS.contracts_options}


class AddedImport:
    """import-linter's graph builder, with one more import in the graph it builds."""

    def __init__(self, importer: str, imported: str):
        self.importer, self.imported = importer, imported

    def build(self, root_package_names, cache_dir, include_external_packages=False,
              exclude_type_checking_imports=False):
        graph = grimp.build_graph(*root_package_names, include_external_packages=include_external_packages,
                                  exclude_type_checking_imports=exclude_type_checking_imports, cache_dir=None)
        graph.add_import(importer=self.importer, imported=self.imported, line_number=1, line_contents="added")
        return graph


def broken(added: AddedImport | None = None) -> set[str]:
    builder = settings.GRAPH_BUILDER
    if added:
        settings.configure(GRAPH_BUILDER=added)
    try:
        report = use_cases.create_report(OPTIONS, cache_dir=None)
    finally:
        settings.configure(GRAPH_BUILDER=builder)
    return {contract.name for contract, check in report.get_contracts_and_checks() if not check.kept}


def names(*ids: str) -> set[str]:
    return {CONTRACTS[i]["name"] for i in ids}


def test_the_tree_keeps_every_contract():
    assert set(CONTRACTS) == {"rooms", "no-torch-in-app", "fastapi-in-api", "worker-not-api", "client-apart",
                              "supervisor-torch-free"}
    assert broken() == set()


@pytest.mark.parametrize("importer, imported, contracts", [
    # a lower room reaching up, and two rooms of one layer reaching across
    ("trainyard.app.core.text", "trainyard.app.db", ("rooms",)),
    ("trainyard.app.jobs.queue", "trainyard.app.sweeps.sweep_store", ("rooms",)),
    ("trainyard.app.fleet.placement", "trainyard.app.lifecycle.retention", ("rooms",)),
    ("trainyard.app.records.job_reads", "trainyard.app.api.deps", ("rooms", "fastapi-in-api", "worker-not-api")),
    ("trainyard.app.jobs.queue", "torch", ("no-torch-in-app", "supervisor-torch-free")),
    ("trainyard.app.api.routes.jobs", "trainyard.worker.runner", ("no-torch-in-app",)),
    ("trainyard.app.fleet.waiting", "fastapi", ("fastapi-in-api",)),
    ("trainyard.worker.runner", "trainyard.app.api", ("worker-not-api", "fastapi-in-api")),
    ("trainyard.app.client.http", "trainyard.app.db", ("client-apart",)),
    ("trainyard.worker.supervisor.prepare", "torch", ("supervisor-torch-free",)),
    ("trainyard.worker.supervisor.main", "trainyard.worker.train", ("supervisor-torch-free",)),
])
def test_a_forbidden_import_breaks_its_contract(importer, imported, contracts):
    assert broken(AddedImport(importer, imported)) == names(*contracts)
