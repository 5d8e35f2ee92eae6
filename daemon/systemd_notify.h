// sd_notify(3) for Type=notify units; a no-op when not started by systemd or built without libsystemd.
#pragma once

namespace trainstream::daemon {
void NotifySystemd(const char* state);
}
