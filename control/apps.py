from django.apps import AppConfig


class ControlConfig(AppConfig):
    name = "control"
    verbose_name = "Control plane"

    def ready(self) -> None:
        from control import dbclock, weights  # noqa: PLC0415 - apps are ready only now

        dbclock.install()
        weights.install()
