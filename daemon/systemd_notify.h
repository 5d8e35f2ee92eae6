// sd_notify(3) for Type=notify units, spoken directly: one datagram with `state` to the Unix socket that
// $NOTIFY_SOCKET names (a path, or "@name" in the abstract namespace). Nothing when it is unset (not
// started by systemd); a warning in the log when it cannot be reached. No libsystemd: the protocol is one
// sendto(), and linking libsystemd put it and the six libraries it loads into every wheel (3.6 MB
// installed, 1.5 MB to download).
#pragma once

namespace trainstream::daemon {
void NotifySystemd(const char* state);
}
