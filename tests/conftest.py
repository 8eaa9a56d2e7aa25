"""Options of the course's test suite."""


def pytest_addoption(parser):
    parser.addoption("--course-wheel", default=None, metavar="WHL",
                     help="the wheel that the environment running the tests was installed from "
                          "(`make test` passes it; tests/test_wheel.py then checks that nothing is "
                          "imported from the repository and reuses the wheel)")
